"""The house rules of the quiver package: imports flow one way.

No two quiver modules import each other, at module level or lazily inside a function (a
circle makes the import order matter and hides which piece sits below the other). A
violation is reported as the pair.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src" / "quiver"


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return [m for m in out if m.startswith("quiver.")]


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for f in ROOT.rglob("*.py"):
        name = "quiver." + ".".join(f.relative_to(ROOT).with_suffix("").parts)
        graph[name.removesuffix(".__init__")] = set(_imports(f))
    return graph


def test_no_module_imports_itself_back():
    """No two modules of the package import each other (at module level or lazily)."""
    graph = _graph()
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


def test_usermodel_sits_below_models():
    """``quiver.usermodel`` (the checkpoint format and loader) does not import
    ``quiver.models`` (Quiver's own GNN, which saves through it); the names stay where they
    were."""
    assert "quiver.models" not in _graph()["quiver.usermodel"]
    code = (
        "from quiver.usermodel import QUIVER_GNN_FACTORY, load_served_model, save_model\n"
        "from quiver.models import FACTORY, SampledGNN, load_checkpoint, save_checkpoint\n"
        "from quiver.models import sampled_gnn\n"
        "assert FACTORY == QUIVER_GNN_FACTORY == 'quiver.models:sampled_gnn'\n"
        "import sys\n"
        "print('quiver.models' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
    bare = "import quiver.usermodel, sys; print('quiver.models' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # loading the format does not pull in the GNN
