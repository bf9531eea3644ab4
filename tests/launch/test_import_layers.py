"""The launcher's packages import one way: a module imports only from the layers its own layer may use.

  smoke     (tools.smoke)      -> launcher (python -m tools.launch), and tools.weights, tools.data
  launcher  (tools.launch)     -> perf, report, settings
  perf      (tools.perf)       -> settings: what a run is, read from its config
  report    (tools.report)     -> nothing of these
  settings  (tools.launch.config, .keys, .layout) -> nothing of these but each other
Every other package under tools/ (model, weights, data, ...) imports none of them. Imports are read with ast from
every module under tools/, those inside functions included, so a lazy import cannot go round the rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {  # layer -> the modules and packages in it; a module belongs to the layer of its longest prefix
    "settings": ("tools.launch.config", "tools.launch.fields", "tools.launch.layout", "tools.launch.rules"),
    "perf": ("tools.perf",),
    "report": ("tools.report",),
    "launcher": ("tools.launch",),
    "smoke": ("tools.smoke",),
}
MAY_IMPORT = {  # layer -> the layers it may import from (its own included)
    "settings": {"settings"},
    "perf": {"perf", "settings"},
    "report": {"report"},
    "launcher": {"launcher", "perf", "report", "settings"},
    "smoke": {"smoke", "launcher"},
    "other": set(),  # tools.model, tools.weights, tools.data, ...
}


def layer(module: str) -> str | None:
    """The layer of a module under tools/ ("other" outside the five); None outside tools/."""
    if module != "tools" and not module.startswith("tools."):
        return None
    found = [(len(p), name) for name, prefixes in LAYERS.items() for p in prefixes
             if module == p or module.startswith(p + ".")]
    return max(found)[1] if found else "other"


def module_name(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: str, source: str, modules: set[str]) -> list[tuple[int, str]]:
    """(line, module) of every import in a file; `from pkg import name` counts as pkg.name when that is a module."""
    name = module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per dot after the first
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((node.lineno, sub if sub in modules else base))
    return out


def violations(files: dict[str, str]) -> list[str]:
    """Each import in `files` (path under the repository -> source) that goes against MAY_IMPORT."""
    modules = {module_name(p) for p in files}
    bad = []
    for path, source in sorted(files.items()):
        own = layer(module_name(path))
        for line, target in imported(path, source, modules):
            theirs = layer(target)
            if own is None or theirs is None or theirs == "other" or theirs in MAY_IMPORT[own]:
                continue
            allowed = ", ".join(sorted(MAY_IMPORT[own])) or "none of launcher, perf, report, settings, smoke"
            bad.append(f"{path}:{line} imports {target} ({theirs}); {own} may import from: {allowed}")
    return bad


def test_imports_flow_one_way():
    files = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "tools").rglob("*.py"))}
    bad = violations(files)
    assert not bad, "\n".join(bad)


def test_every_layer_names_modules_that_exist():
    for name, prefixes in LAYERS.items():
        for prefix in prefixes:
            path = ROOT / prefix.replace(".", "/")
            assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), f"{name}: {prefix}"


def test_a_wrong_way_import_is_named_with_its_line():
    files = {
        "tools/perf/__init__.py": "",
        "tools/perf/timing.py": "from tools.launch import layout\n\ndef f():\n    from tools.launch import run\n",
        "tools/launch/__init__.py": "",
        "tools/launch/layout.py": "from tools.perf.timing import f\n",
        "tools/launch/run.py": "from tools.perf import timing\nfrom tools.report import summary\n",
        "tools/report/__init__.py": "",
        "tools/report/summary.py": "from . import curves\nimport tools.launch.cli\n",
        "tools/report/curves.py": "",
        "tools/model/dims.py": "from ..perf import timing\n",
    }
    assert violations(files) == [
        "tools/launch/layout.py:1 imports tools.perf.timing (perf); settings may import from: settings",
        "tools/model/dims.py:1 imports tools.perf.timing (perf); other may import from: none of launcher, perf,"
        " report, settings, smoke",
        "tools/perf/timing.py:4 imports tools.launch.run (launcher); perf may import from: perf, settings",
        "tools/report/summary.py:2 imports tools.launch.cli (launcher); report may import from: report",
    ]
