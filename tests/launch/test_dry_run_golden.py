"""The dry run of every profile, as `python -m tools.launch CONFIG --dry-run` prints it, byte for byte against
tests/launch/golden/dryrun-<case>.txt (UPDATE_GOLDEN=1 to accept a change): moving code between modules must not
change what a user reads.

It runs cli.main (what `python -m tools.launch` runs) in-process from the repository root with the command's own
arguments. Fixed are only what differs between machines and runs, each where it is read:
- the run id, <config>-<UTC time> by default: RUN_ID=dryrun, as a user sets it;
- what the node finds out about itself (route to MASTER_ADDR, jemalloc): FACTS, as a host without jemalloc does;
- a cpu profile's device memory, the host's RAM per device: CPU_DEVICE_GB (a3's is the datasheet's 64 GB);
- RAY_AUTH_MODE=disabled, which ~/.ray/auth_token would otherwise decide;
- the folder of this Python, printed in the plan's `ray` and `python` commands: replaced by <bin>;
- the repository's path, printed in model paths and the run dir: replaced by <root>.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.launch.conftest import ROOT
from tools.launch import cli, env, layout, run

GOLDEN = Path(__file__).parent / "golden"
FACTS = env.NodeFacts("127.0.0.1", "lo", "127.0.0.1", True, None)  # a one-node run, no jemalloc installed
CPU_DEVICE_GB = 8.0
WHAT_IF = ("--what-if", "actor_rollout_ref.tensor_cache.enable=false")  # the --help's example
CASES = {  # golden file -> the command's arguments
    "a3-128-true-weight": ("recipes/deepseek_r1/configs/a3-128-true-weight.yaml", "--dry-run"),
    "a3-128-random-init": ("recipes/deepseek_r1/configs/a3-128-random-init.yaml", "--dry-run"),
    "cpu-tiny": ("recipes/deepseek_r1/configs/cpu-tiny.yaml", "--dry-run"),
    "cpu-tiny-fsdp": ("recipes/deepseek_r1/configs/cpu-tiny-fsdp.yaml", "--dry-run"),
    "a3-128-true-weight-what-if": ("recipes/deepseek_r1/configs/a3-128-true-weight.yaml", "--dry-run", *WHAT_IF),
    "a3-128-random-init-what-if": ("recipes/deepseek_r1/configs/a3-128-random-init.yaml", "--dry-run", *WHAT_IF),
}


def dry_run(args: tuple[str, ...], monkeypatch, capsys) -> str:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("RUN_ID", "dryrun")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setattr(env, "gather_facts", lambda master: FACTS)
    monkeypatch.setattr(run, "device_memory_gb", lambda acc, per_node: layout.DEVICE_MEMORY_GB.get(acc, CPU_DEVICE_GB))
    capsys.readouterr()
    rc = cli.main(list(args))
    out = capsys.readouterr()
    assert rc == run.EXIT_OK and not out.err, f"{' '.join(args)}: exit {rc}\n{out.err}"
    return out.out.replace(str(Path(sys.executable).parent) + "/", "<bin>/").replace(str(ROOT), "<root>")


@pytest.mark.parametrize("case", CASES)
def test_dry_run_prints_what_it_printed(case, monkeypatch, capsys):
    text = dry_run(CASES[case], monkeypatch, capsys)
    golden = GOLDEN / f"dryrun-{case}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"the dry run changed: UPDATE_GOLDEN=1 pytest {__file__} to accept"
