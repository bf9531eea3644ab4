"""A verl release from the package index, unpacked once, and checks run against it in a subprocess.

The tests of the patches we drop on moving to a newer verl show that the release does, without our series, what the
patch did. CI has the package index but no git mirror, so the release comes as its sdist (sha256 checked by
tools.forks.sources, as `tools.forks sync --source pypi` does) and is laid out under the download cache. A check is a
function of tests/verl/upstream_checks.py, run by this interpreter (the cpu stack's) in a fresh process whose
PYTHONPATH puts the release's tree before the stack's own verl (our fork at the pin); the project's root comes first
for `tests`, a name the sdist has too, and has no `verl` of its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from tests import stack
from tools.forks import manifest as manifest_mod
from tools.forks import sources
from tools.forks.manifest import PyPISource

ROOT = Path(__file__).resolve().parents[2]
# sha256 of each sdist, as PyPI's simple index gives it (checked on download)
RELEASES = {
    "0.6.1": "3512c7529ad46321f1b9c0e448c2b336eb9f7d8d1af2c4948770f5adc9068c39",
    "0.4.0": "2ff0e65759256f49577a868ff1032bb7b2f5e827707a3cf403acbaab575fb6e3",
}
CHECK_TIMEOUT_S = 900  # a hung check fails with what it said; imports alone take minutes on a loaded 2-core machine


def release_tree(version: str) -> Path:
    """The unpacked sdist of verl `version` (fetched and checked on first use); missing if the index is out of
    reach (a skip locally, a failure under RL_RECIPE_REQUIRE_STACK=1)."""
    fork = manifest_mod.load(ROOT).forks["verl"]
    release = replace(fork, pypi=PyPISource(f"verl=={version}", f"verl-{version}.tar.gz", RELEASES[version]))
    dest = sources.cache_dir().parent / "trees" / f"verl-{version}"
    marker = dest / ".sha256"
    if marker.is_file() and marker.read_text() == RELEASES[version]:
        return dest
    indexes = [os.environ.get("PIP_INDEX_URL") or sources.DEFAULT_INDEX]
    try:
        archive = sources.download(release, sources.find_distribution(release, indexes, []), progress=False)
    except (sources.SourceError, OSError) as exc:
        stack.missing(f"verl {version}'s sdist could not be had ({exc})",
                      "reach a package index (PIP_INDEX_URL) that has it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    try:
        sources.unpack(release, archive, staging)
        (staging / ".sha256").write_text(RELEASES[version])
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def run_check(tree: Path, version: str, name: str, *args: str, timeout: float = CHECK_TIMEOUT_S) -> str:
    """Run upstream_checks.<name>(*args) with `tree`'s verl first on the path; its output, or AssertionError with
    what the process said."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tree)]), "VLLM_PLUGINS": "none",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONDONTWRITEBYTECODE": "1"}
    code = ("import sys; from tests.verl import upstream_checks as c;"
            f" c.loaded_from({str(tree)!r}, {version!r}); c.{name}(*sys.argv[1:])")
    with tempfile.TemporaryDirectory() as scratch:
        proc = subprocess.run([sys.executable, "-c", code, *args], cwd=scratch, env=env, capture_output=True,
                              text=True, timeout=timeout)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"upstream_checks.{name} against verl {version} exited {proc.returncode}:\n{said}"
    return said
