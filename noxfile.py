"""Sessions for building, checking and testing the stack: `nox -l` lists them.

Sessions stay thin: the logic lives in importable, tested modules under tools/.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests", "lint"]

PYPROJECT = nox.project.load_toml("pyproject.toml")


@nox.session(python=False, default=False)
def install(session: nox.Session) -> None:
    """Install the whole stack into .venv (args: --device npu|cuda|cpu, --dry-run, --wheelhouse DIR)."""
    session.run(sys.executable, "-m", "tools.install", "install", *session.posargs, external=True)


@nox.session(python=False, default=False)
def wheelhouse(session: nox.Session) -> None:
    """Collect everything install needs into a folder, for air-gapped clusters (args: --device, --dest)."""
    session.run(sys.executable, "-m", "tools.install", "wheelhouse", *session.posargs, external=True)


@nox.session(python=False, default=False)
def lock(session: nox.Session) -> None:
    """Write requirements/<device>.lock from the installed .venv (args: --device)."""
    session.run(sys.executable, "-m", "tools.install", "lock", *session.posargs, external=True)


@nox.session(python=False, default=False)
def forks(session: nox.Session) -> None:
    """Manage the pinned forks and their patch series (args go to `python -m tools.forks`)."""
    session.run(sys.executable, "-m", "tools.forks", *(session.posargs or ["status"]), external=True)


@nox.session(python=False, default=False, name="upgrade-report")
def upgrade_report(session: nox.Session) -> None:
    """Try each fork's series on its next upstream releases; write third_party/patches/UPGRADE.md (args go to
    `python -m tools.forks upgrade-report`, e.g. `-- --render-only`)."""
    session.run(sys.executable, "-m", "tools.forks", "upgrade-report", *session.posargs, external=True)


# The tests run inside the cpu profile of the stack (torch, Megatron-core, verl, vLLM from our forks),
# kept apart from the user's own .venv; installing it is a no-op when nothing changed.
TEST_STACK = ".nox/stack-cpu"
REQUIRE_STACK = "RL_RECIPE_REQUIRE_STACK"  # read by tests/stack.py
# one pytest-xdist worker per core, up to 4 (each test may start several processes); the groups: tests/parallel.py
WORKERS = ("--numprocesses", "auto", "--maxprocesses", "4")
PARALLEL = (*WORKERS, "--dist", "loadscope", "--no-loadscope-reorder")
FORK_PARALLEL = (*WORKERS, "--dist", "loadfile")  # the forks' trees have no conftest of ours: by file


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """Run the CPU test suite inside the cpu stack, installed first (what CI runs); args go to pytest."""
    session.run(sys.executable, "-m", "tools.install", "--device", "cpu", "--venv", TEST_STACK, external=True)
    python = f"{TEST_STACK}/bin/python"
    session.run(python, "-m", "pip", "install", "--quiet", *nox.project.dependency_groups(PYPROJECT, "test"),
                external=True)
    # A missing stack or fork source fails the tests instead of skipping them (tests/stack.py); only
    # RL_RECIPE_REQUIRE_STACK=0 nox -s tests lets them skip, as a bare pytest run does.
    require = os.environ.get(REQUIRE_STACK, "1")
    # vLLM-Ascend is NPU-only, so the cpu stack does not install it; tests/vllm_ascend and its series' own
    # tests (test_profiles in forks.toml) read its patched source instead (sync + apply, both no-ops when
    # done). sync exits 2 when it could fetch the tree from neither git nor PyPI: CI can always reach PyPI,
    # so that fails the run unless the switch is off.
    session.run(sys.executable, "-m", "tools.forks", "sync", "vllm-ascend", external=True,
                success_codes=[0] if require == "1" else [0, 2])
    have_ascend = Path("third_party/vllm-ascend/vllm_ascend").is_dir()
    if have_ascend:
        session.run(sys.executable, "-m", "tools.forks", "apply", "vllm-ascend", external=True)
    session.run(python, "-m", "pytest", *PARALLEL, *session.posargs, external=True,
                env={"PYTHONFAULTHANDLER": "1", REQUIRE_STACK: require})
    if not session.posargs:  # the tests our patches add to the forks' own trees, against the installed stack
        forks = []
        if not have_ascend:
            session.warn(f"the vLLM-Ascend source is absent ({REQUIRE_STACK}=0): its series' tests do not run")
            forks = _forks_tested_on_cpu_but("vllm-ascend")
        session.run(python, "-m", "tools.forks", "test", "--profile", "cpu", *forks, "--", *FORK_PARALLEL,
                    external=True)


def _forks_tested_on_cpu_but(absent: str) -> list[str]:
    """The forks whose series' tests the cpu profile runs, less one whose tree the switch let stay absent."""
    from tools.forks.manifest import load

    return [f.name for f in load(Path.cwd()).select(profile="cpu", tests=True) if f.name != absent]


@nox.session(python=False)
def smoke(session: nox.Session) -> None:
    """The recipe end to end on CPU: the cpu stack (installed first, as for tests), then GRPO steps of the tiny
    DeepSeek-V3 model; args go to `python -m tools.smoke` (e.g. `nox -s smoke -- --steps 20`)."""
    session.run(sys.executable, "-m", "tools.install", "--device", "cpu", "--venv", TEST_STACK, external=True)
    session.run(f"{TEST_STACK}/bin/python", "-m", "tools.smoke", *session.posargs, external=True)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """Lint the project's own code with ruff (third_party/ excluded)."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", ".")
