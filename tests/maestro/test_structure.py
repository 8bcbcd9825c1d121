"""The house rules of the maestro package: imports flow one way.

Schedulers are pure functions and the simulator replays them; neither may import the runtime
(the executor owns devices and processes), the profilers that launch real runs, the planner
above them, or the workloads; schedulers do not import the simulator either (it builds on
them). A violation is a module and the import that breaks the rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src" / "maestro"

#: package -> maestro packages it must not import
FORBIDDEN = {
    "schedule": {"sim", "runtime", "profiling", "plan", "workloads", "parallel", "hf", "data"},
    "sim": {"runtime", "profiling", "plan", "workloads", "parallel", "hf", "data"},
    "parallel": {"plan", "sim", "profiling"},
}


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return [m for m in out if m.startswith("maestro.")]


def test_imports_flow_one_way():
    bad = []
    for pkg, banned in FORBIDDEN.items():
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for mod in _imports(f):
                if mod.split(".")[1] in banned:
                    bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_no_module_imports_itself_back():
    """No two modules of one package import each other (at module level or lazily)."""
    graph: dict[str, set[str]] = {}
    for f in ROOT.rglob("*.py"):
        name = "maestro." + ".".join(f.relative_to(ROOT).with_suffix("").parts)
        name = name.removesuffix(".__init__")
        graph[name] = set(_imports(f))
    pairs = sorted(
        f"{a} <-> {b}"
        for a, deps in graph.items()
        for b in deps
        if b in graph
        and a in graph[b]
        and a < b
        and not b.startswith(a + ".")
        and not a.startswith(b + ".")
    )
    assert not pairs, "\n".join(pairs)


def test_the_job_api_and_config_sit_below_the_runtime():
    """``config``, ``job`` and ``sections`` are what a user's job imports; the runtime builds
    on them, never the reverse (config -> job -> runtime.local -> config was a circle)."""
    bad = [
        f"{name} imports {mod}"
        for name in ("config.py", "job.py", "sections.py")
        for mod in _imports(ROOT / name)
        if mod.split(".")[1] in ("runtime", "plan", "sim", "profiling")
    ]
    assert not bad, "\n".join(bad)
