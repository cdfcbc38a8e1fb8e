"""The checkpoint package's layering: its modules import one another one way (no cycle,
no import inside a function to dodge one), and none imports the package's ``__init__``,
which only re-exports."""

from __future__ import annotations

import ast
from pathlib import Path

import shardspec.runtime.checkpoint as package

PACKAGE = "shardspec.runtime.checkpoint"
FOLDER = Path(package.__file__).parent


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported name within the package, at module level) for each import in ``path``:
    a submodule's name, or ``""`` for the package itself."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
            if node.module == PACKAGE:  # "from package import submodule" or a name
                names = [f"{PACKAGE}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                sub = name.removeprefix(PACKAGE).lstrip(".").split(".")[0]
                out.append((sub if (FOLDER / f"{sub}.py").exists() else "", id(node) in top))
    return out


def _graph() -> dict[str, set[str]]:
    return {
        path.stem: {name for name, _ in _imports(path)}
        for path in FOLDER.glob("*.py")
        if path.stem != "__init__"
    }


def _order(graph: dict[str, set[str]]) -> list[str] | None:
    """The modules, each after those it imports; None where the imports form a cycle."""
    order: list[str] = []
    todo = dict(graph)
    while todo:
        ready = sorted(m for m, deps in todo.items() if deps <= set(order))
        if not ready:
            return None
        order += ready
        for m in ready:
            del todo[m]
    return order


def test_modules_import_one_way_at_module_level() -> None:
    graph = _graph()
    assert {"api", "planners", "staging", "folders", "locality"} <= set(graph)
    assert all("" not in deps for deps in graph.values()), graph  # never the __init__
    for path in FOLDER.glob("*.py"):
        lazy = [name for name, top in _imports(path) if not top]
        assert lazy == [], (path.name, lazy)
    order = _order(graph)
    assert order is not None, graph
    assert order.index("planners") < order.index("locality") < order.index("api")


def test_a_cycle_or_a_lazy_import_is_seen(tmp_path: Path) -> None:
    """The checks above can fail: the old layout (locality subclassing a planner of the
    module that imported locality inside ``load``) is a cycle, and its import is lazy."""
    graph = _graph()
    graph["planners"] = graph["planners"] | {"locality"}
    assert _order(graph) is None
    (tmp_path / "api.py").write_text(
        f"def load():\n    from {PACKAGE}.locality import LocalityLoadPlanner\n",
        encoding="utf-8",
    )
    assert _imports(tmp_path / "api.py") == [("locality", False)]
    (tmp_path / "locality.py").write_text(
        f"from {PACKAGE} import ShardspecLoadPlanner\n", encoding="utf-8"
    )
    assert _imports(tmp_path / "locality.py") == [("", True)]
