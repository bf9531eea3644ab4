"""The suite's spread over pytest-xdist workers (tests/parallel.py): each module whole on one worker, the modules that
start Ray clusters together on one worker and first, and every such module listed."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

from tests import parallel

ROOT = Path(__file__).resolve().parents[1]
# what starts a Ray cluster in a test module: Ray's own calls, or a launch of the recipe
STARTS_RAY = re.compile(r"ray\.init\(|ray\.cluster_utils|run_smoke\(|smoke_command\(")


def test_every_module_that_starts_ray_is_in_the_ray_group():
    modules = (ROOT / "tests").rglob("test_*.py")
    starting = {str(p.relative_to(ROOT)) for p in modules if STARTS_RAY.search(p.read_text())}
    assert starting, "the pattern finds the modules that start clusters"
    unlisted = sorted(starting - parallel.RAY_CLUSTER_MODULES)
    assert not unlisted, f"start Ray clusters, but not in tests/parallel.py:RAY_CLUSTER_MODULES: {unlisted}"
    missing = {m for m in parallel.RAY_CLUSTER_MODULES if not (ROOT / m).is_file()}
    assert not missing, f"listed but gone: {sorted(missing)}"


CONFTEST = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from tests import parallel
from tests.parallel import pytest_collection_modifyitems, pytest_xdist_make_scheduler
parallel.RAY_CLUSTER_MODULES = frozenset({{"test_ray_a.py", "test_ray_b.py"}})
"""

def test_two_workers_keep_each_module_whole_and_the_ray_modules_together_and_first(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name in ("plain_a", "ray_a", "plain_b", "ray_b", "plain_c"):  # the Ray modules not first in collection
        (tmp_path / f"test_{name}.py").write_text(textwrap.dedent("""
            import pytest, time
            @pytest.mark.parametrize("i", range(4))
            def test_it(i):
                time.sleep(0.05)
        """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "--numprocesses", "2",
                          "--dist", "loadscope", "--no-loadscope-reorder", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ran = re.findall(r"\[(gw\d)\] \[\s*\d+%\] PASSED (test_\w+)\.py::", out.stdout)
    assert len(ran) == 20, out.stdout[-3000:]
    workers = defaultdict(set)
    for worker, module in ran:
        workers[module].add(worker)
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
    assert workers["test_ray_a"] == workers["test_ray_b"]
    (ray_worker,) = workers["test_ray_a"]
    on_it = [module for worker, module in ran if worker == ray_worker]
    assert on_it[:8] == ["test_ray_a"] * 4 + ["test_ray_b"] * 4, on_it
