"""The package's layers (README, "Project layout"): every module imports only its own layer
and the layers above it, the runtime only the core, and the core nothing of shardspec."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "shardspec"

# The compiler's layers, top to bottom: a module may import its own layer and those above.
COMPILER = (
    "core",
    "findings",
    "frontend",
    "inputs",
    "resolve",
    "checks",
    "codegen",
    "api",
    "explain",
    "transfer",
    "diff",
    "cli",
)
# Apart from the compiler: what generated modules import at train time, and the test harness.
RUNTIME = ("core", "runtime")
ALLOWED = {layer: set(COMPILER[: i + 1]) for i, layer in enumerate(COMPILER)}
ALLOWED["core"] = {"core"}
ALLOWED["runtime"] = set(RUNTIME)
ALLOWED["testing"] = {"testing"}
ALLOWED["__main__"] = {"cli"}


def _layer(module: str) -> str | None:
    """``shardspec.X.Y`` -> ``X``; ``shardspec`` itself (version constants) -> None."""
    parts = module.split(".")
    if parts[0] != "shardspec" or len(parts) == 1:
        return None
    return parts[1].removesuffix(".py")


def _imports(path: Path, text: str | None = None) -> list[tuple[int, str]]:
    """Every shardspec module ``path`` (or ``text`` as if it were that file) imports, at
    any depth (lazy imports too), relative imports resolved."""
    out = []
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    source = path.read_text(encoding="utf-8") if text is None else text
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base == "shardspec":  # `from shardspec import ir` names a module
                out += [(node.lineno, f"shardspec.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, base))
    return [(line, m) for line, m in out if m.split(".")[0] == "shardspec"]


MODULES = sorted(p for p in ROOT.rglob("*.py") if p.name != "__init__.py" or p.parent != ROOT)


def test_every_module_belongs_to_a_layer() -> None:
    layers = {_layer(".".join(p.relative_to(ROOT.parent).with_suffix("").parts)) for p in MODULES}
    assert layers <= set(ALLOWED), layers - set(ALLOWED)


def _violations(path: Path, text: str | None = None) -> list[str]:
    own = _layer(".".join(path.relative_to(ROOT.parent).with_suffix("").parts))
    assert own is not None
    return [
        f"{path.relative_to(ROOT.parent)}:{line} imports {module}"
        for line, module in _imports(path, text)
        if (layer := _layer(module)) is not None
        and layer not in ALLOWED[own]
        and layer not in {"__init__", "__version__", "RUNTIME_API"}
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_layers(path: Path) -> None:
    wrong = _violations(path)
    assert not wrong, "\n".join(wrong)


def test_the_scan_catches_lazy_relative_and_parent_imports() -> None:
    """A core module that imports the runtime inside a function, the checks through a
    relative import, or the compiler's IR through ``from shardspec import ir`` is caught;
    the version constants are not layers."""
    core = ROOT / "core" / "layout.py"
    text = (
        "from shardspec import __version__\n"
        "from . import patterns\n"
        "def f():\n"
        "    from shardspec.runtime import spec\n"
        "    from ..checks import run\n"
        "    from shardspec import ir\n"
    )
    assert _violations(core, text) == [
        "shardspec/core/layout.py:4 imports shardspec.runtime",
        "shardspec/core/layout.py:5 imports shardspec.checks",
        "shardspec/core/layout.py:6 imports shardspec.ir",
    ]
    runtime = ROOT / "runtime" / "hf.py"
    assert _violations(runtime, "from shardspec.inputs import load\n") == [
        "shardspec/runtime/hf.py:1 imports shardspec.inputs"
    ]
