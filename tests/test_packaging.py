"""The built wheel holds the whole package: every module under ``shardspec/``, the grammar
and the code generator's templates (issue 20: a wheel without ``shardspec.explain`` made
``shardspec explain`` fail in every non-editable install). ``.ci/wheel`` goes further: it
installs the wheel into a fresh venv and runs every command from it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from shardspec import cli

REPO = Path(__file__).resolve().parents[1]


def _build_wheel(tmp: Path) -> zipfile.ZipFile:
    """The wheel built from a copy of what the build reads (so that no ``build/`` left in the
    checkout can add stale modules), without build isolation: offline, in seconds."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        if (REPO / name).exists():  # setup.py: where the packages are found
            shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("shardspec", "grammars"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    run = subprocess.run(
        [*pip, "-w", str(tmp / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    (wheel,) = (tmp / "dist").glob("shardspec-*.whl")
    return zipfile.ZipFile(wheel)


def test_the_wheel_holds_every_module_the_grammar_and_the_templates(tmp_path: Path) -> None:
    with _build_wheel(tmp_path) as wheel:
        names = set(wheel.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = wheel.read(entry_points).decode()
    source = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "shardspec").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert any(s.startswith("shardspec/explain/") for s in source)  # the module
    missing = sorted(source - names)
    assert not missing, f"the wheel lacks {missing}: check setup.py's package discovery"
    assert "shardspec/grammars/shardspec.lark" in names
    assert "shardspec/codegen/templates/module.py.j2" in names
    assert "shardspec = shardspec.cli:main" in scripts
    # Nothing from outside the package (tests, examples, the grammar folder as itself).
    assert {n.split("/")[0] for n in names} == {"shardspec", wheel_dist_info(names)}


def wheel_dist_info(names: set[str]) -> str:
    (info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    return info


def test_manifest_without_torch_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The one command that needs torch says so in an environment without it (a wheel
    installed for lint alone), instead of a traceback."""
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    monkeypatch.chdir(REPO)
    out = tmp_path / "m.json"
    assert cli.main(["manifest", "-o", str(out), "examples.models.llama:tiny"]) == 2
    err = capsys.readouterr().err
    assert "needs torch" in err and "pip install torch" in err, err
    assert "Traceback" not in err and not out.exists()
