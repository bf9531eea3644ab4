"""tools.reward.verl_entry: the signature verl calls, its dispatch, and loading it by file path as verl does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.reward.verl_entry import MATH_SOURCES, compute_score

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("data_source", sorted(MATH_SOURCES))
def test_math_sources_use_the_strict_reward(data_source):
    assert compute_score(data_source, r"so \boxed{\frac{1}{2}}", "0.5", {"index": 0}) == 1.0
    assert compute_score(data_source, "the year 2024, answer 7", "2", None) == 0.0


def test_keywords_as_the_reward_manager_passes_them():
    assert compute_score(data_source="openai/gsm8k", solution_str=r"\boxed{1,234}", ground_truth="1234",
                         extra_info={"split": "test"}) == 1.0


def test_reward_kwargs_select_the_lax_rule():
    assert compute_score("deepscaler", "the year 2024, answer 7", "2", None, mode="lax") == 1.0


def test_unknown_data_source_is_named():
    with pytest.raises(ValueError, match="'lighteval/MATH'"):
        compute_score("lighteval/MATH", r"\boxed{1}", "1")


def test_loads_by_file_path_from_another_directory(tmp_path):
    # verl imports custom_reward_function.path with spec_from_file_location; `tools` is not on sys.path there.
    entry = str(ROOT / "tools" / "reward" / "verl_entry.py")
    script = (
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('custom_module', {entry!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "print(module.compute_score('synthetic-arith', r'\\boxed{153}', '153', {'index': 3}, timeout_s=60))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1.0"
